"""Prewarm: enumerate variants and compile them ahead of time into images.

Reserved for the prewarm issue (tuning table, images, ``lazytriton prewarm``);
nothing is implemented here yet. Until then a missing variant is compiled just
in time by ``lazytriton.runtime``.
"""
