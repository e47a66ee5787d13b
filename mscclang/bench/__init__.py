"""mscclang.bench"""
