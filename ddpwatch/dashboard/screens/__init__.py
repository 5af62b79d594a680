"""Modal screens: help and the strategy picker."""
