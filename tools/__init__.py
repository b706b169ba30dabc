"""Developer tools that are not part of the installed service (`make proto`, ...)."""
