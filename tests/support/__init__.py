"""Test support shared by every test folder: bitwise equality, states, storages, child processes."""
