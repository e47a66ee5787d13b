"""mscclang.runtime"""
