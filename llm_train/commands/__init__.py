"""The `llm-train` subcommands beyond train: each module registers its parser and runs one command."""
