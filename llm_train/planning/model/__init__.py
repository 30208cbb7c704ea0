"""What the model is, sized offline: its shape (text and image-text) from a known id or a config.json."""
