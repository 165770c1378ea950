"""Drop-in integrations of gaengine with the trainers users already run; each submodule imports its framework only when imported itself."""
