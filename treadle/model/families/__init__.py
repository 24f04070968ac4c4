"""treadle.model.families"""
