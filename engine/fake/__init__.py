"""The fakes the actors are tested against in virtual time: the deterministic fake GPU, its drafter, and the fault-injecting disk."""
