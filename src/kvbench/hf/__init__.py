"""Any Hugging Face causal LM: loading it (models.py) and transformers running our GPT-2 (engine.py)."""
