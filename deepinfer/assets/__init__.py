"""Files shipped inside the package: the embedded tiny model's tokenizer.json (deepinfer/embedded.py)."""
