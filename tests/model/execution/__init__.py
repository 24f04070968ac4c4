"""tests.model.execution"""
