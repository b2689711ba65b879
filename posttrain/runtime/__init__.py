"""How stages run: the warm stage host, process lifetimes, launched ranks, this machine's checks, dead runs."""
