"""``distrain bench elastic``: what elasticity costs when nothing fails, and how fast it recovers.

    cost.py  fixed and elastic runs of the same job alternated (per-step time, ratio per round); a rank
             killed (kill -> first step at the smaller size); a rank killed and replaced (join time)
"""
