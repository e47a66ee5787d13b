"""mscclang.algorithms"""
