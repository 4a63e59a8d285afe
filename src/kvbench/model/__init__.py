"""GPT-2 from scratch (gpt2.py), its weights from a Hugging Face checkpoint (model/weights.py), its tokenizer."""
