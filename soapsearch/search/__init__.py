"""The search: MCMC over SOAP configs scored by the simulator (``search()``, configured by a
``SearchConfig``), and an optuna outer loop over the global knobs (``study_search()``)."""

from soapsearch.search.api import SearchResult, search
from soapsearch.search.config import SearchConfig
from soapsearch.search.mcmc import Budget, plan_cost
from soapsearch.search.study import StudyResult, study_search

__all__ = ["Budget", "SearchConfig", "SearchResult", "StudyResult", "plan_cost", "search", "study_search"]
