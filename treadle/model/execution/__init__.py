"""treadle.model.execution"""
