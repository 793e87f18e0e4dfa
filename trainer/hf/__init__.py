"""trainer.hf"""
