"""What verify and break check: the exactness checks, on our GPT-2 and on any Hugging Face model, and the injected faults."""
