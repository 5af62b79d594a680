"""The Textual dashboard: feeds → session → snapshot → widgets."""
