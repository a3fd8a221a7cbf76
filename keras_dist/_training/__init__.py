"""_training"""
