"""``poolrunner.integrations``: adapters for other projects' harnesses (:mod:`poolrunner.core.integrations`)."""
