"""mscclang.sim"""
