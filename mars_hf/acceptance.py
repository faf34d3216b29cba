"""How MARS predictions are chosen and accepted. Being written (issue 10)."""
