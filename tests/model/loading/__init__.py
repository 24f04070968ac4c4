"""tests.model.loading"""
