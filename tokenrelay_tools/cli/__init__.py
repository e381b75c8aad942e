"""The `tokenrelay` command line: up, generate, chat, hash-key."""
