"""mscclang.dsl"""
