"""Server side: everything that reads only what clients upload (weights, prototypes, sample counts)."""
