"""The model both roles build: the built-in networks and their flat views."""
