"""_input"""
