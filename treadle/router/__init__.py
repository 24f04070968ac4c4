"""The standalone router (`treadle router`): one HTTP front in front of several `treadle serve` workers, routing by the policy in `treadle/routing/`."""
