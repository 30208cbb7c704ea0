"""Small bundled assets (corpus, tokenizer, chat examples) for the ``tiny-cpu`` demo recipe."""
