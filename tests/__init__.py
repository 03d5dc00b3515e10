"""minrl's tests by module; the algorithm tests are ../test_algos.py."""
