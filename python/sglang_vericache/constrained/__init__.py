"""Grammar-constrained decoding (regex, JSON schema, EBNF) on xgrammar."""
