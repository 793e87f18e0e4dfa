"""trainer.train"""
