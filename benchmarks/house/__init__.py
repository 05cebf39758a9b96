"""Checks of the source tree's shape: how long the commands and their files are, how many
modules each package folder holds."""
