"""_keras"""
