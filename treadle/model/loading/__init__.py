"""treadle.model.loading"""
