"""``distrain bench link``: calibrate.py fits alpha and beta of every link by ping-pong (and gamma of
the adds): the calibration the cost model and ``distrain bench comm --predict`` read."""
