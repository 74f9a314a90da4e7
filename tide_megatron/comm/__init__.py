"""How the ranks of a job talk: the control mailbox, the weight transport, the topology and
its process groups. Rollout, trainer and controller all import this package; it imports none
of them."""
