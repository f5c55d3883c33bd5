"""Widgets and cell formats the console's views are made of."""
