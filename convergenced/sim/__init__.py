"""Deterministic cluster simulator: the real sans-IO core over a simulated network.

Many `NodeCore`s talk through real `Link` state machines and real frames over
simulated connections, in virtual time, with faults injected from a seeded swarm
plan, and an oracle checks S1-S5 of DESIGN.md against ground truth after every
event. Same seed and same code give the same trace hash.
"""
