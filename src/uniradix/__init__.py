"""uniradix: a prefix cache for hybrid LLMs."""
