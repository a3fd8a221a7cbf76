"""_values"""
