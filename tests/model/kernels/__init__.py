"""tests.model.kernels"""
