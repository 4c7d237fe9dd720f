"""poolrunner's built-in plugins: one package per plugin, registered like third-party ones."""
