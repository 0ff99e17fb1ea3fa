"""The search: MCMC over SOAP configs scored by the simulator (``search()``), and an optuna
outer loop over the global knobs (``study_search()``)."""

from soapsearch.search.api import SearchResult, search
from soapsearch.search.mcmc import Budget, plan_cost
from soapsearch.search.study import StudyResult, study_search

__all__ = ["Budget", "SearchResult", "StudyResult", "plan_cost", "search", "study_search"]
