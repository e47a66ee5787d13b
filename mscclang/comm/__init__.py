"""mscclang.comm"""
