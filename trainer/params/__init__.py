"""trainer.params"""
