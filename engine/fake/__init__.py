"""The deterministic fake GPU the actors are tested against in virtual time."""
