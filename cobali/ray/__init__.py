"""Ray integrations (optional extra: pip install 'cobali[ray]'). Nothing outside this package imports
Ray, and this package is imported only when a --ray flag asks for it."""
