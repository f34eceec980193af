"""MHA2MLA."""
