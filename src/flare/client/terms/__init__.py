"""Loss terms: each returns named scalar losses computed from one batch's model outputs."""
