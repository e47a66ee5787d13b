"""mscclang.compiler"""
